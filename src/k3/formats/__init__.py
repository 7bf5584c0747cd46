"""What k3 writes to disk and reads back, below every package that does either (STYLE rule 15).

    tokenizer    the byte-level BPE and its tokenizer.json, with the special tokens (the chat format's too)
    files        atomic whole-file writes, the fsynced append of metrics.jsonl, stale-temp cleanup
    checkpoint   the step checkpoint step_XXXXXXXX/ (safetensors + a self-checksummed meta.json)
    run_record   run.json: what a run folder was made from, and how a reuse of it differs

`train`, `distill`, `spec`, `hub`, `serve`, `chat` and `cli` import these; they import nothing of k3 but the
config and the model's tensor names (what a checkpoint needs).
"""
