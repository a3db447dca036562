"""LightningModules and LightningDataModules, one task per module."""
