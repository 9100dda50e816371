"""Tools on top of the package: what the commands run besides studies (``stagetree gc``)."""
