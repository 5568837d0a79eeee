"""The one bus client (asyncio and threaded; its streams, dead letters and URLs) and the one
state store (with its Lua scripts, sentinel client and in-memory twin)."""
