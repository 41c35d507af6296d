"""Data: the Grain input pipeline (pipeline.py), prepared shards (shards.py, prepare.py, buckets.py), the built-in
tokenizer (tokenizer.py) and the procedural captioned-shapes dataset (synthetic/)."""
