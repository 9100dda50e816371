"""The engine behind every study: modules core, coordination, settings, pool, ledger."""
