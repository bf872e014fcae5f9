"""hap: SPMD training on heterogeneous GPU clusters by program synthesis."""
