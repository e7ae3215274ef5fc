"""The agent feature: the `agent` workflow and its OpenAI-compatible endpoint, on exact token transcripts."""
