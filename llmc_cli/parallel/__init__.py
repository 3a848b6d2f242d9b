"""Data parallel: who-is-who among the ranks, the communicators the engine falls back on, ZeRO, and the
launchers that start one process per device."""
