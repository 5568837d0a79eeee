"""What every service shares: the service base, durable delivery, replica ownership, metrics, tracing, alerts."""
