"""A trainer rank: its loop, and one version's training (the synchronous loop's too)."""
