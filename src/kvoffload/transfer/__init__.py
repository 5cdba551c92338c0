"""Worker side: moving bytes between media. Decides nothing."""
