"""The OpenAI-compatible endpoint of a generator: agents' chat calls as engine requests on exact token transcripts."""
