"""Small helpers shared by the stages (no stage logic here)."""
