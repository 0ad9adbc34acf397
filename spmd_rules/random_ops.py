"""Placeholder: rules for this family are being written."""
