"""What every service shares: the service base, how it takes messages in, durable delivery,
replica ownership, its command line, metrics, tracing, alerts."""
