"""The local stack: embedded nats-server and Valkey (single or replicated), `trainguard up`, credentials."""
