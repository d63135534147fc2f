"""Ids of the samples cut from one regenerated conversation (`tokenize.turn_samples: every`): generated turn K of
conversation SAMPLE is `SAMPLE#turnK` (0-based), except the last turn, which keeps SAMPLE. The held-out split hashes
the conversation, so a conversation's turns are trained on or held out together (turn K's context holds the
target's answers to the turns before it)."""

from __future__ import annotations

TURN_SEP = "#turn"


def turn_sample_id(sample_id: str, k: int, last: int) -> str:
    return sample_id if k == last else f"{sample_id}{TURN_SEP}{k}"


def conversation_id(sample_id: str) -> str:
    """`SAMPLE#turnK` -> SAMPLE; any other id unchanged."""
    base, sep, k = sample_id.rpartition(TURN_SEP)
    return base if sep and k.isdigit() else sample_id
