"""The kernel: actors on trio, their inboxes, futures, supervision, event channels and records."""
