"""What every stage shares and none owns: files written whole or not at all, appended whole
lines at a time, and every failed write named (`atomic`), tensor digests (`digests`), the
machine and code a result came from and the memory and disk it has (`environment`), the errors
that name a user's mistake (`errors`), strict YAML reading (`yaml_file`), what a path is
(`paths`) and lazily named package surfaces (`lazy`). Imports no other part of mtp."""
