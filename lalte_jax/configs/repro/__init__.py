"""The configs of the small reproduction study."""
