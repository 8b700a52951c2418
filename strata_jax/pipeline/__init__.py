"""Running stages: placement and hand-off (`stages`), jitted windows in a bounded compile cache (`windows`), group
resolution (`groups`), the host loop (`scheduler`) and the engine API (`engine`)."""
