"""The user's data: row sources (JSONL, Parquet, a `datasets` directory), the prompt stream
over them, and the example sets shipped in `data/` (`synth`)."""
