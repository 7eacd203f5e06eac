"""Adapters to training frameworks (optional extras)."""
