"""The operator's tools: console, replay (record, play, decide), diagnose, report, breaker, node, status, schema export."""
