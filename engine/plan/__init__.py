"""Plans: the YAML schema, loading with `base:` and overrides, and the cross-checks (no torch)."""
