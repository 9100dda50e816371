"""The engine: one per storage in a process, running the scheduler over an executor.

:mod:`~stagetree.engine.core` holds the engine, :mod:`~stagetree.engine.coordination`
its cooperation with other processes, :mod:`~stagetree.engine.settings` its settings
and the command-line overrides, :mod:`~stagetree.engine.pool` the engines open in a
process.
"""
