"""Speculative decoding for rollouts: suffix-match drafts from a trajectory's own context, its group's siblings
and the same task's earlier epochs, and their acceptance measured on recorded traces."""
