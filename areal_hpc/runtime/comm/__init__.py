"""What every rank shares: the messages, the role loop, hang detection, weight sync and the event timeline."""
