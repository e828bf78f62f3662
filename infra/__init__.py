"""Wiring shared by every component: settings, Kafka, the store, logging, errors, the CLI."""
