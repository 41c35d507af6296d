"""Prepare image-caption data as ArrayRecord shards for training (data.name=shards; docs/data.md).

    # a folder of images with <name>.txt captions (or a captions.jsonl), 256 px center crops, MiniLM embeddings
    python scripts/prepare_data.py folder /data/photos --out /data/shards256 --resolution 256 --encoder minilm

    # WebDataset tars, aspect buckets with the token budget of 512 px at patch 16
    python scripts/prepare_data.py webdataset /data/wds/*.tar --out /data/shards512 --resolution 512 \
        --buckets --patch 16 --bucket-multiple 64 --image-format jpeg

    # the synthetic shapes with real frozen embeddings, then train on them
    python scripts/prepare_data.py synthetic --num 100000 --image-size 32 --out /data/synth32 --encoder minilm \
        --max-len 32
    python scripts/train.py --config configs/tiny.py --workdir runs/synth_minilm --config.data.name=shards \
        --config.data.path=/data/synth32 --config.text.encoder=precomputed --config.text.emb_dim=384

Rerunning the same command resumes an interrupted run (finished shards are kept). Bad images and missing
captions are skipped and listed in <out>/manifest.json.
"""

from reve_jax.data.cli import main

if __name__ == "__main__":
    main(doc=__doc__)
