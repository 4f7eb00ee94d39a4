"""Trajectory-length predictors."""
