"""Integrations with training frameworks; each module imports its framework and nothing else does."""
