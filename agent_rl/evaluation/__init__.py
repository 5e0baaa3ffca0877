"""Evaluation: held-out tasks played by each policy with fixed seeds (`evaluate`), and the BFCL benchmark judged by
bfcl-eval's own checker in its own Python (`bfcl`, `bfcl_checker`, `bfcl_worker`)."""
