"""Store tests: one contract suite (contract.py) run on every store."""
