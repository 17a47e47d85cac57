"""Test helpers: writers of reference stores, independent of asyncflat's own writer."""
