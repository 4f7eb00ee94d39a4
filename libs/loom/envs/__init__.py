"""Environments a trajectory runs in."""
