"""After training: what a run learned, used in one process (no process group, no FSDP).

    merge.py        the base as trained plus the adapter; merged and exported (kit merge), the
                    checkpoints listed and verified (kit checkpoints)
    gguf_export.py  a merged folder as one GGUF file (kit merge --gguf)
    chat.py         talk to the adapter on its base (kit chat)
"""
