{{/*
Names, labels and the pieces the router and worker templates share.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "<release>-<name>", or just the release when it already holds the name, or fullnameOverride.
     Kept at 50 characters so that "-prefill", "-decode", "-router" and "-kv-auth" suffixes still fit in 63. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "pdserve.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of one component's objects: (dict "root" $ "component" "prefill"). */}}
{{- define "pdserve.componentName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .component -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{/* Labels that select one component's pods: (dict "root" $ "component" "prefill"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of one component's objects: (dict "root" $ "component" "prefill"). */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret and key the workers read the KV auth token from. */}}
{{- define "pdserve.kvAuthSecretName" -}}
{{- default (printf "%s-kv-auth" (include "pdserve.fullname" .)) .Values.kvAuth.existingSecret -}}
{{- end -}}
{{- define "pdserve.kvAuthSecretKey" -}}
{{- if .Values.kvAuth.existingSecret -}}{{ .Values.kvAuth.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* "repo:tag" of one component: (dict "root" $ "component" "prefill" "gpu" true). Workers with gpu.enabled
     use the CUDA tag; the router always the CPU tag unless its own image.tag says otherwise. */}}
{{- define "pdserve.image" -}}
{{- $v := .root.Values -}}
{{- $own := (index $v .component).image -}}
{{- $tag := default .root.Chart.AppVersion $v.image.tag -}}
{{- if .gpu -}}
{{- $tag = default (printf "%s-cuda" .root.Chart.AppVersion) $v.image.cudaTag -}}
{{- end -}}
{{- printf "%s:%s" (default $v.image.repository $own.repository) (default $tag $own.tag) -}}
{{- end -}}

{{- define "pdserve.imagePullPolicy" -}}
{{- default .root.Values.image.pullPolicy (index .root.Values .component).image.pullPolicy -}}
{{- end -}}

{{/* The `--model` value every process gets, or nothing for the bundled model. */}}
{{- define "pdserve.modelArg" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "name" -}}
{{- required "model.path is the --model value when model.source is name" $m.path -}}
{{- else if has $m.source (list "pvc" "image") -}}
{{- if $m.path -}}{{ printf "/models/%s" (trimPrefix "/" $m.path) }}{{- else -}}/models{{- end -}}
{{- end -}}
{{- end -}}

{{/* Checks of values the schema cannot express; rendered (as nothing) by every workload. */}}
{{- define "pdserve.validate" -}}
{{- $m := .Values.model -}}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) -}}
{{- fail "model.source is pvc: set model.pvc.claimName" -}}
{{- end -}}
{{- if and (eq $m.source "image") (not $m.image.repository) -}}
{{- fail "model.source is image: set model.image.repository" -}}
{{- end -}}
{{- if not .Values.decode.enabled -}}
{{- fail "decode.enabled is false: the router needs decode workers" -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) -}}
{{- fail "tls.enabled: set tls.secretName (a Secret with tls.crt, tls.key and ca.crt)" -}}
{{- end -}}
{{- if and .Values.kvAuth.enabled .Values.kvAuth.token .Values.kvAuth.existingSecret -}}
{{- fail "kvAuth: set either token or existingSecret, not both" -}}
{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $w := index $.Values $role -}}
{{- if and $.Values.gpu.enabled (not (kindIs "invalid" $w.gpus)) (lt (int $w.gpus) (int $w.tp)) -}}
{{- fail (printf "%s.gpus (%v) is less than %s.tp (%v): each TP rank needs its own GPU" $role $w.gpus $role $w.tp) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The model volume of every pod (pvc: the claim, read-only; image: the emptyDir the init container fills). */}}
{{- define "pdserve.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "image" }}
- name: model
  emptyDir:
    {{- with $m.image.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelMount" -}}
{{- if has .Values.model.source (list "pvc" "image") }}
- name: model
  mountPath: /models
  readOnly: true
{{- end }}
{{- end -}}

{{/* The init container that copies the model out of the model image (model.source=image). */}}
{{- define "pdserve.modelInitContainers" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "image" }}
initContainers:
  - name: copy-model
    image: {{ printf "%s:%s" $m.image.repository $m.image.tag | quote }}
    imagePullPolicy: {{ $m.image.pullPolicy }}
    command: ["cp", "-R", {{ printf "%s/." (trimSuffix "/" $m.image.sourcePath) | quote }}, "/models/"]
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: /models
{{- end }}
{{- end -}}

{{/* Pod-level fields every component shares: (dict "root" $ "component" "router"). */}}
{{- define "pdserve.podCommon" -}}
{{- $c := index .root.Values .component -}}
serviceAccountName: {{ include "pdserve.serviceAccountName" .root }}
automountServiceAccountToken: {{ .root.Values.serviceAccount.automountToken }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . }}
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
{{- with $c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A container's security context: the top-level one with the component's merged over it. */}}
{{- define "pdserve.containerSecurityContext" -}}
{{- $c := index .root.Values .component -}}
{{- toYaml (mustMergeOverwrite (deepCopy .root.Values.securityContext) (deepCopy $c.securityContext)) -}}
{{- end -}}

{{/* mTLS (tls.enabled): the variables every pdserve process reads, the Secret's volume and its mount. */}}
{{- define "pdserve.tlsEnv" -}}
{{- $t := .Values.tls -}}
{{- if $t.enabled }}
- name: PDSERVE_TLS_CERT
  value: /etc/pdserve/tls/{{ $t.certKey }}
- name: PDSERVE_TLS_KEY
  value: /etc/pdserve/tls/{{ $t.keyKey }}
- name: PDSERVE_TLS_CA
  value: /etc/pdserve/tls/{{ $t.caKey }}
- name: PDSERVE_TLS_SERVER_NAME
  value: {{ $t.serverName | quote }}
{{- end }}
{{- end -}}

{{- define "pdserve.tlsVolume" -}}
{{- $t := .Values.tls -}}
{{- if $t.enabled }}
- name: tls
  secret:
    secretName: {{ $t.secretName }}
    # Readable by the pod's fsGroup (the containers' group), by nobody else.
    defaultMode: 0440
    items:
      - key: {{ $t.certKey }}
        path: {{ $t.certKey }}
      - key: {{ $t.keyKey }}
        path: {{ $t.keyKey }}
      - key: {{ $t.caKey }}
        path: {{ $t.caKey }}
{{- end }}
{{- end -}}

{{- define "pdserve.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/pdserve/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
A worker probe: the kubelet's gRPC probe, or with mTLS on `pdserve health` in the container (it dials with the
pod's certificate; a kubelet's gRPC probe cannot). (dict "root" $ "port" <port>)
*/}}
{{- define "pdserve.workerProbe" -}}
{{- if .root.Values.tls.enabled }}
exec:
  command: ["pdserve", "health", "--port", {{ .port | toString | quote }}]
{{- else }}
grpc:
  port: {{ .port }}
{{- end }}
{{- end -}}

{{/* Probe timing fields from a probeTiming value. */}}
{{- define "pdserve.probeTiming" -}}
periodSeconds: {{ .periodSeconds }}
timeoutSeconds: {{ .timeoutSeconds }}
failureThreshold: {{ .failureThreshold }}
{{- end -}}

{{/* The PodDisruptionBudget of one component: (dict "root" $ "component" "prefill"). */}}
{{- define "pdserve.pdb" -}}
{{- $c := index .root.Values .component -}}
{{- $pdb := $c.podDisruptionBudget -}}
{{- if $pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pdserve.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "pdserve.componentLabels" . | nindent 4 }}
spec:
  {{- if not (kindIs "invalid" $pdb.minAvailable) }}
  minAvailable: {{ $pdb.minAvailable }}
  {{- else if not (kindIs "invalid" $pdb.maxUnavailable) }}
  maxUnavailable: {{ $pdb.maxUnavailable }}
  {{- else }}
  {{- fail (printf "%s.podDisruptionBudget: set maxUnavailable or minAvailable" .component) }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- /* job="pdserve-router", "pdserve-prefill" or "pdserve-decode" (from the Services' component label): the
     job names deploy/prometheus/prometheus.yml gives the components, which the alert rules select by. */}}
{{- define "pdserve.jobRelabeling" -}}
- sourceLabels: [__meta_kubernetes_service_label_app_kubernetes_io_component]
  targetLabel: job
  replacement: pdserve-$1
{{- end -}}
