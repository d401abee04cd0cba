"""``longweave inspect``: read what ``longweave pack`` wrote, summarise it, show one sample, verify it, report it.

Users open shards here before they spend GPU-weeks on them, so every reader in this package reports a damaged file
(with the shard and the sample key) instead of crashing on it.
"""
