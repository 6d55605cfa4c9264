"""What every stage shares and none owns: files written whole or not at all (`atomic`), tensor
digests (`digests`), the machine and code a result came from (`environment`), the errors that
name a user's mistake (`errors`), strict YAML reading (`yaml_file`) and lazily named package
surfaces (`lazy`). Imports no other part of mtp."""
