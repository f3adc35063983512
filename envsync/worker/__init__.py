"""The worker process's side: the receivers that apply versions to an env (one per env
object; the rows of a natively batched env as columns), who owns the env when, where it
lives, and the one loop that serves every end of a link in a process."""
