-- outboxkit 0008: a confirmation keeps its own evidence.
--
-- Until now the evidence of a confirmation (apply_confirmation, or the operations ledger
-- settling a run) went to the run's last_evidence and to the history row of the move only.
-- A durable agent (agents/) resumes a tool call with the result of the confirmation of *its*
-- message, looked up by confirmation id: last_evidence is overwritten by the run's next write,
-- and a history row is not keyed by the confirmation. NULL for confirmations applied before.
ALTER TABLE {schema}.confirmations ADD COLUMN evidence jsonb;
