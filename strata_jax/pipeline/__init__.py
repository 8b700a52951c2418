"""Running stages: placement and hand-off (`stages`), jitted windows in a bounded compile cache (`windows`), group
resolution (`groups`), the engine API (`engine`), one sequence's emit / stop / proposal rule (`sequence`), the solo
loop (`solo`), the batch scheduler (`scheduler`) and its thread for concurrent callers (`loop`). No command-line
code: the commands in `strata_jax.cli` are clients of this package."""
