"""Runtime role loops: how a run drives engines, the store and the ledger."""
