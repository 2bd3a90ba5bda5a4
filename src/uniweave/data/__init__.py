"""Datasets: the embedded digits tasks, generic JSONL/parquet loading, templates."""
