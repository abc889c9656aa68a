#!/usr/bin/env bash
# `make demo`: the main job. Not built yet — this says so rather than pretend.
echo "make demo: the end-to-end demo (a real fine-tune on the local cluster) is not built yet." >&2
echo "See README.md for what works today." >&2
exit 1
