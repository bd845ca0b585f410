"""Repository tools (not installed as a library API): checkpoint converter, asset helpers."""
