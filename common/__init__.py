"""Small helpers that both `data/` and `model/` need (neither may import the other); imports no meshlm package.

- `segments.positions_from_segments`: RoPE positions of packed documents, on NumPy (data pipeline) or JAX (model).
"""
