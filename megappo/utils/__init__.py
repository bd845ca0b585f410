"""Utilities: experiment tracking, timers, checkpoint io."""
