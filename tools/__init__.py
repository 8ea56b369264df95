"""Maintainer tools run from a kvtune checkout; not part of the installed package."""
