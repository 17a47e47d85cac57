"""Integrations with training frameworks; each module imports its framework and nothing else does.

May import: ``*``; integrations sit on top of the house.
"""
