"""The session layer: a Session (one model, preset and budget over an engine), routing capture, speculative
decoding, and the verbs that run one (info, convert, probe-disk, generate)."""
