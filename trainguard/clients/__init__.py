"""The one bus client and the one state store (with its Lua scripts, sentinel client and in-memory twin)."""
