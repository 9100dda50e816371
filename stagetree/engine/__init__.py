"""The engine: one per storage in a process, running the scheduler over an executor.

:mod:`~stagetree.engine.core` holds the engine (one record per running batch, one
handler per executor event), :mod:`~stagetree.engine.ledger` what it writes down
(activity, learning curves, accounting), :mod:`~stagetree.engine.coordination` its
cooperation with other processes through a narrow port,
:mod:`~stagetree.engine.settings` its settings and the command-line overrides, and
:mod:`~stagetree.engine.pool` the engines open in a process.
"""
