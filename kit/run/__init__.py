"""Starting and watching runs, kernel side: the check, the launcher, the run handle, jobs."""
