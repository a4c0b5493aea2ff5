"""A deployment's worker processes: started, watched, restarted and stopped (fleet), by a launcher
(launcher: local processes or Ray actors; netns_launch: on hosts in network namespaces, netns)."""
