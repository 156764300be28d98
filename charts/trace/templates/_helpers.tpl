{{/* Names, labels and shared pod pieces of the TRACE chart. */}}

{{- define "trace.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "trace.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: <fullname>-<component>. Call with (list $ "rollout"). */}}
{{- define "trace.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "trace.fullname" $root) (index . 1) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "trace.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "trace.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trace
{{- end -}}

{{/* Selector labels of one component. Call with (list $ "rollout"). */}}
{{- define "trace.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "trace.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Labels of a component's pods: the common labels plus the component. Call with (list $ "rollout"). */}}
{{- define "trace.podLabels" -}}
{{ include "trace.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "trace.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "trace.authSecretName" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else -}}
{{- printf "%s-auth" (include "trace.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "trace.redisSecretName" -}}
{{- if .Values.redis.existingSecret -}}
{{- .Values.redis.existingSecret -}}
{{- else -}}
{{- printf "%s-redis" (include "trace.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* host:port of a component's gRPC server through its Service. Call with (list $ "weight-sync" port). */}}
{{- define "trace.grpcAddress" -}}
{{- $root := index . 0 -}}
{{- printf "%s:%v" (include "trace.componentName" (list $root (index . 1))) (index . 2) -}}
{{- end -}}

{{/*
Environment shared by every TRACE container: the token file and the pod's name and IP (for
$(VAR) references).
*/}}
{{- define "trace.commonEnv" -}}
- name: TRACE_AUTH_TOKEN_FILE
  value: /var/run/secrets/trace/token
- name: POD_NAME
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{- end -}}

{{/* Pod-level pieces every TRACE pod shares: security context, pull secrets, scheduling. */}}
{{- define "trace.podSpecCommon" -}}
{{- $root := index . 0 -}}
{{- $c := index . 1 -}}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The TRACE container of one component. Call with (list $ "rollout" <component values> <extra env YAML or "">).
It runs `trace-rl serve <component>` with gRPC and HTTP ports, probes (see below), the
hardened security context, the token Secret, writable /tmp and /data.
*/}}
{{- define "trace.container" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $c := index . 2 -}}
{{- $v := $root.Values -}}
- name: {{ $name }}
  image: {{ include "trace.image" $root | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if gt (int (default 1 $c.ranks)) 1 }}
  {{- /* N learner ranks in this pod, one GPU each (LOCAL_RANK); rank 0 serves. */}}
  command: ["torchrun"]
  args: ["--standalone", "--nproc-per-node={{ $c.ranks }}", "--no-python", "trace-rl", "serve", {{ $name | quote }}]
  {{- else }}
  args: ["serve", {{ $name | quote }}]
  {{- end }}
  env:
    {{- include "trace.commonEnv" $root | nindent 4 }}
    {{- /* Reached through its Service: every interface of the pod (gRPC, HTTP, and
    weight-sync's data plane, which binds the gRPC host). */}}
    - name: TRACE_GRPC_HOST
      value: "0.0.0.0"
    - name: TRACE_HTTP_HOST
      value: "0.0.0.0"
    - name: TRACE_GRPC_PORT
      value: {{ $c.grpcPort | quote }}
    - name: TRACE_HTTP_PORT
      value: {{ $c.httpPort | quote }}
    {{- with $c.dataPlanePort }}
    - name: TRACE_DATA_PLANE_PORT
      value: {{ . | quote }}
    {{- end }}
    {{- with (index . 3) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- /* The component's own `env` last, so it can override any of the above. */}}
    {{- range $k, $val := $c.env }}
    - name: {{ $k }}
      value: {{ $val | quote }}
    {{- end }}
  envFrom:
    - configMapRef:
        name: {{ include "trace.fullname" $root }}-config
  ports:
    - {name: grpc, containerPort: {{ $c.grpcPort }}, protocol: TCP}
    - {name: http, containerPort: {{ $c.httpPort }}, protocol: TCP}
    {{- with $c.dataPlanePort }}
    - {name: data, containerPort: {{ . }}, protocol: TCP}
    {{- end }}
    {{- with $c.broadcastPort }}
    - {name: broadcast, containerPort: {{ . }}, protocol: TCP}
    {{- end }}
  # Readiness: grpc.health.v1 (SERVING only once the service is ready, e.g. a rollout replica
  # holds weights). Startup/liveness: HTTP /healthz (process up), because the gRPC health
  # status is NOT_SERVING while a replica waits for its first weights, which must not restart it.
  startupProbe:
    httpGet: {path: /healthz, port: http}
    periodSeconds: {{ $v.probes.startup.periodSeconds }}
    failureThreshold: {{ $v.probes.startup.failureThreshold }}
  livenessProbe:
    httpGet: {path: /healthz, port: http}
    periodSeconds: {{ $v.probes.liveness.periodSeconds }}
    failureThreshold: {{ $v.probes.liveness.failureThreshold }}
    timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
  readinessProbe:
    grpc: {port: {{ $c.grpcPort }}}
    periodSeconds: {{ $v.probes.readiness.periodSeconds }}
    failureThreshold: {{ $v.probes.readiness.failureThreshold }}
    timeoutSeconds: {{ $v.probes.readiness.timeoutSeconds }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  resources:
    {{- $res := deepCopy $c.resources }}
    {{- if gt (int (default 0 $c.gpus)) 0 }}
    {{- $limits := default (dict) $res.limits }}
    {{- $_ := set $limits "nvidia.com/gpu" (int $c.gpus) }}
    {{- $_ := set $res "limits" $limits }}
    {{- end }}
    {{- toYaml $res | nindent 4 }}
  volumeMounts:
    - {name: auth-token, mountPath: /var/run/secrets/trace, readOnly: true}
    - {name: tmp, mountPath: /tmp}
    - {name: data, mountPath: /data}
    {{- if gt (int (default 1 $c.ranks)) 1 }}
    - {name: dshm, mountPath: /dev/shm}
    {{- end }}
    {{- if eq $name "trainer" }}
    - {name: recipe, mountPath: {{ include "trace.recipeDir" $root }}, readOnly: true}
    {{- if $root.Values.trainer.datasets.existingClaim }}
    - {name: datasets, mountPath: /opt/trace/data, readOnly: true}
    {{- end }}
    {{- end }}
{{- end -}}

{{/* Volumes of the TRACE container; the trainer replaces `data` by its PVC. */}}
{{- define "trace.volumes" -}}
{{- $root := index . 0 -}}
{{- $withData := index . 1 -}}
- name: auth-token
  secret:
    secretName: {{ include "trace.authSecretName" $root }}
    defaultMode: 0440
    items:
      - {key: {{ $root.Values.auth.secretKey }}, path: token}
- name: tmp
  emptyDir: {}
{{- if $withData }}
- name: data
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* TRACE_REDIS_URL for quant-cache: the in-chart Redis (password from its Secret) or external. */}}
{{- define "trace.redisEnv" -}}
{{- $r := .Values.redis -}}
{{- if $r.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "trace.redisSecretName" . }}
      key: {{ $r.secretKey }}
- name: TRACE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "trace.componentName" (list . "redis")) | quote }}
{{- else if $r.external.existingSecret }}
- name: TRACE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.external.existingSecret }}
      key: {{ $r.external.secretKey }}
{{- else if $r.external.url }}
- name: TRACE_REDIS_URL
  value: {{ $r.external.url | quote }}
{{- else }}
{{- fail "redis.enabled is false: set redis.external.url or redis.external.existingSecret" }}
{{- end }}
{{- end -}}

{{/* A ClusterIP Service for one component's gRPC and HTTP ports. Call with (list $ name values). */}}
{{- define "trace.service" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $c := index . 2 -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "trace.componentName" (list $root $name) }}
  labels:
    {{- include "trace.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $name }}
spec:
  selector:
    {{- include "trace.selectorLabels" (list $root $name) | nindent 4 }}
  ports:
    - {name: grpc, port: {{ $c.grpcPort }}, targetPort: grpc, appProtocol: grpc}
    - {name: http, port: {{ $c.httpPort }}, targetPort: http}
    {{- with $c.dataPlanePort }}
    {{- /* weight-sync's bulk data plane: replicas dial this Service name at this port. */}}
    - {name: data, port: {{ . }}, targetPort: data}
    {{- end }}
{{- end -}}

{{/* Where the trainer and the rollout replicas find the two stores (gRPC host:port). They
read and write records in Redis directly at the address quant-cache hands out (its own
TRACE_REDIS_URL, a Service name in this namespace), so no Redis setting is needed here. */}}
{{- define "trace.storeEnv" -}}
{{- $v := .Values -}}
- name: TRACE_QUANT_CACHE_ADDRESS
  value: {{ include "trace.grpcAddress" (list . "quant-cache" $v.quantCache.grpcPort) | quote }}
- name: TRACE_WEIGHT_SYNC_ADDRESS
  value: {{ include "trace.grpcAddress" (list . "weight-sync" $v.weightSync.grpcPort) | quote }}
{{- end -}}

{{/* Rollout: each pod registers with weight-sync under its pod name at its pod IP. */}}
{{/* TRACE_DEVICE of a compute component: cuda when its pod requests GPUs (the device plugin
gives each pod its own, numbered from 0 inside it: every rollout replica has its own GPU),
else cpu. A component's `env.TRACE_DEVICE` overrides it (e.g. cuda:1 with gpus: 2). */}}
{{- define "trace.deviceEnv" -}}
- name: TRACE_DEVICE
  value: {{ if gt (int (default 0 .gpus)) 0 }}"cuda"{{ else }}"cpu"{{ end }}
{{- end -}}

{{- define "trace.rolloutEnv" -}}
{{ include "trace.storeEnv" . }}
{{ include "trace.deviceEnv" .Values.rollout }}
- name: TRACE_REPLICA_ID
  value: "$(POD_NAME)"
- name: TRACE_ADVERTISE_HOST
  value: "$(POD_IP)"
{{- end -}}

{{/* Trainer: its run from the recipe ConfigMap; checkpoints and metrics.jsonl on its
PersistentVolumeClaim (/data). */}}
{{- define "trace.trainerEnv" -}}
{{ include "trace.storeEnv" . }}
{{ include "trace.deviceEnv" .Values.trainer }}
- name: TRACE_RECIPE
  value: {{ printf "%s/recipe.toml" (include "trace.recipeDir" .) | quote }}
- name: TRACE_CHECKPOINT_DIR
  value: /data/checkpoints
- name: TRACE_METRICS_FILE
  value: /data/metrics.jsonl
# A recipe's relative dataset / tokenizer / model paths ("data/math-word/train.jsonl") resolve
# here: the image's example data, or trainer.datasets.existingClaim mounted over it.
- name: TRACE_DATA_ROOT
  value: /opt/trace
# The broadcast store of new versions (NCCL to replicas on other nodes): every interface of
# the pod, reached by the replicas at its IP.
- name: TRACE_BROADCAST_HOST
  value: "$(POD_IP)"
- name: TRACE_BROADCAST_PORT
  value: {{ .Values.trainer.broadcastPort | quote }}
{{- end -}}

{{/*
An HPA's replica bounds, checked when rendering (JSON schema cannot compare two fields):
(list "values.path" $autoscaling).
*/}}
{{- define "trace.checkAutoscaling" -}}
{{- $path := index . 0 }}
{{- $a := index . 1 }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "%s.minReplicas (%d) must be <= %s.maxReplicas (%d)" $path (int $a.minReplicas) $path (int $a.maxReplicas)) }}
{{- end }}
{{- end }}

{{/* Where the trainer's recipe ConfigMap (templates/recipe.yaml) is mounted. */}}
{{- define "trace.recipeDir" -}}
/etc/trace
{{- end -}}

{{/*
A map as TOML (the trainer's recipe): its scalar and list keys, then each map as a [table],
recursively. Call with (list "" $map); values are written as JSON, which is valid TOML for
strings, numbers, booleans and lists of them; null keys are left out (their default).
*/}}
{{- define "trace.toml" -}}
{{- $prefix := index . 0 -}}
{{- $table := index . 1 -}}
{{- range $k, $v := $table }}
{{- if and (not (kindIs "map" $v)) (not (kindIs "invalid" $v)) }}
{{ $k }} = {{ $v | toJson }}
{{- end }}
{{- end }}
{{- range $k, $v := $table }}
{{- if kindIs "map" $v }}
{{- $name := ternary $k (printf "%s.%s" $prefix $k) (eq $prefix "") }}

[{{ $name }}]
{{- include "trace.toml" (list $name $v) }}
{{- end }}
{{- end }}
{{- end -}}
